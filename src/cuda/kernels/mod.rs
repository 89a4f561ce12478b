//! One typed launcher per kernel, each module beside its CUDA source: `gdn_decode.rs` launches
//! the kernels of `gdn_decode.cu`, and so on. A kernel's parameters are a struct whose fields
//! are the CUDA parameters in order and by their CUDA names ([`kernels!`]); the test
//! `signatures_match_the_sources` parses the CUDA sources and fails on any difference of name,
//! order or type, so a reordered or retyped kernel parameter fails CI instead of corrupting
//! memory. Each struct's `launch` states the kernel's shape contract once (`ensure!`) and
//! computes its grid. The forward pass (`prefill.rs`, `decode.rs`) fills these structs; no kernel
//! name appears there.

use super::{Arg, DeviceBuf, Gpu};
use std::marker::PhantomData;

pub mod attn_decode;
pub mod attn_prefill;
pub mod gdn_chunk;
pub mod gdn_decode;
pub mod gdn_state;
pub mod gemv;
pub mod misc;
pub mod moe_decode;
pub mod moe_gemm;
pub mod moe_route;
pub mod norm;
pub mod sample;
pub mod trace;

/// A typed device pointer: `len` elements of `T` at `ptr`; [`Dev::null`] where a kernel takes
/// a null pointer for "absent".
pub struct Dev<T> {
    pub ptr: u64,
    pub len: usize,
    _t: PhantomData<T>,
}

impl<T> Clone for Dev<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Dev<T> {}

impl<T> std::fmt::Debug for Dev<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}[{}]", self.ptr, self.len)
    }
}

impl<T> Dev<T> {
    /// `len` elements at device address `ptr`.
    pub const fn new(ptr: u64, len: usize) -> Self {
        Dev {
            ptr,
            len,
            _t: PhantomData,
        }
    }

    /// No buffer (a null pointer).
    pub const fn null() -> Self {
        Self::new(0, 0)
    }

    pub fn is_null(&self) -> bool {
        self.ptr == 0
    }

    /// The elements from `n` on (the same buffer, `n` elements in).
    pub fn at(self, n: usize) -> Self {
        assert!(
            n <= self.len,
            "offset {n} past a buffer of {} elements",
            self.len
        );
        Self::new(self.ptr + (n * size_of::<T>()) as u64, self.len - n)
    }
}

/// The element of a CUDA `uint4` buffer (16 bytes).
pub type U128 = [u32; 4];

impl DeviceBuf {
    /// The buffer as elements of `T`.
    pub fn view<T>(&self) -> Dev<T> {
        Dev::new(self.ptr, self.bytes / size_of::<T>())
    }
    pub fn f32(&self) -> Dev<f32> {
        self.view()
    }
    pub fn bf16(&self) -> Dev<half::bf16> {
        self.view()
    }
    pub fn i32(&self) -> Dev<i32> {
        self.view()
    }
}

/// A kernel parameter: how it is passed, and the CUDA types it stands for.
pub trait Param {
    /// The CUDA parameter types this Rust type passes (`const` or not).
    const CUDA: &'static [&'static str];
    fn arg(&self) -> Arg;
}

macro_rules! pointer_param {
    ($t:ty, $cuda:literal) => {
        impl Param for Dev<$t> {
            const CUDA: &'static [&'static str] =
                &[concat!($cuda, "*"), concat!("const ", $cuda, "*")];
            fn arg(&self) -> Arg {
                Arg::Ptr(self.ptr)
            }
        }
    };
}
pointer_param!(f32, "float");
pointer_param!(half::bf16, "bf16");
pointer_param!(i32, "int");
pointer_param!(u32, "unsigned");
pointer_param!(u64, "u64");
pointer_param!(U128, "uint4");

/// A `void*` parameter: a buffer whose element type the kernel fixes (`moe_gemm6`'s output).
#[derive(Clone, Copy, Debug)]
pub struct Untyped(pub u64);

impl<T> From<Dev<T>> for Untyped {
    fn from(d: Dev<T>) -> Self {
        Untyped(d.ptr)
    }
}

impl Param for Untyped {
    const CUDA: &'static [&'static str] = &["void*"];
    fn arg(&self) -> Arg {
        Arg::Ptr(self.0)
    }
}

impl Param for i32 {
    const CUDA: &'static [&'static str] = &["int"];
    fn arg(&self) -> Arg {
        Arg::I(*self)
    }
}

impl Param for u32 {
    const CUDA: &'static [&'static str] = &["unsigned"];
    fn arg(&self) -> Arg {
        Arg::I(*self as i32)
    }
}

impl Param for f32 {
    const CUDA: &'static [&'static str] = &["float"];
    fn arg(&self) -> Arg {
        Arg::F(*self)
    }
}

impl Param for u64 {
    const CUDA: &'static [&'static str] = &["u64"];
    fn arg(&self) -> Arg {
        Arg::U(*self)
    }
}

/// A kernel family's signature: the CUDA kernels that share it and their parameters (name,
/// the CUDA types the Rust field passes).
#[cfg(test)]
pub struct Signature {
    pub names: &'static [&'static str],
    pub params: &'static [(&'static str, &'static [&'static str])],
}

/// The parameter structs of a module's kernels: `Name ["cuda_kernel", ...] { field: Type, .. }`
/// with the fields in the kernels' parameter order, named as in CUDA; the struct gets
/// `NAMES` and `args()`, the module a `SIGNATURES` table for the signature test.
macro_rules! kernels {
    ($( $(#[$doc:meta])* $name:ident [$($cuda:literal),+ $(,)?] { $($field:ident : $ty:ty),* $(,)? } )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Copy, Debug)]
            pub struct $name { $(pub $field: $ty),* }
            impl $name {
                /// The CUDA kernels that take these parameters.
                pub const NAMES: &'static [&'static str] = &[$($cuda),+];
                #[allow(dead_code)]
                fn args(&self) -> Vec<$crate::cuda::Arg> {
                    vec![$($crate::cuda::kernels::Param::arg(&self.$field)),*]
                }
            }
        )*
        /// This module's kernels and their parameters, for the signature test.
        #[cfg(test)]
        pub(super) const SIGNATURES: &[$crate::cuda::kernels::Signature] = &[$(
            $crate::cuda::kernels::Signature {
                names: $name::NAMES,
                params: &[$((stringify!($field), <$ty as $crate::cuda::kernels::Param>::CUDA)),*],
            }
        ),*];
    };
}
pub(crate) use kernels;

/// How a launch is ordered on its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    /// A prefill kernel on the main stream, with programmatic dependent launch after one of
    /// ours ([`Gpu::launch_dep`]).
    Prefill,
    /// A decode-step kernel on the main stream, with programmatic dependent launch when set.
    Decode(bool),
    /// A plain launch on the main stream.
    Plain,
    /// The second stream (after [`Gpu::fork_aux`]).
    Aux,
}

impl Gpu {
    /// Launches `name` as `on` says.
    pub(crate) fn run(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
        on: On,
    ) -> anyhow::Result<()> {
        let smem = smem as u32;
        match on {
            On::Prefill => self.launch_dep(name, grid, block, smem, args),
            On::Decode(pdl) => self.launch_ex(name, grid, block, smem, args, pdl),
            On::Plain => self.launch(name, grid, block, smem, args),
            On::Aux => self.launch_on(self.stream_of(true), name, grid, block, smem, args, false),
        }
    }
}

/// Kernels that use more than the default 48 KiB of dynamic shared memory, with the most
/// each may use (set when the GPU is opened): `max_smem` is the GPU's opt-in limit.
pub(super) fn dynamic_smem(max_smem: usize) -> Vec<(&'static str, usize)> {
    let mut v = Vec::new();
    v.extend(attn_prefill::dynamic_smem());
    v.extend(attn_decode::dynamic_smem());
    v.extend(moe_gemm::dynamic_smem());
    v.extend(moe_route::dynamic_smem());
    v.extend(gemv::dynamic_smem());
    v.extend(gdn_chunk::dynamic_smem(max_smem));
    v.extend(gdn_state::dynamic_smem(max_smem));
    v
}

/// The `.entry` names of a PTX module: every kernel it holds.
pub(super) fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next()?.trim().to_string())
        })
        .collect()
}

/// Every kernel's signature, from each module's [`kernels!`] table.
#[cfg(test)]
fn all_signatures() -> Vec<&'static Signature> {
    [
        attn_decode::SIGNATURES,
        attn_prefill::SIGNATURES,
        gdn_chunk::SIGNATURES,
        gdn_decode::SIGNATURES,
        gdn_state::SIGNATURES,
        gemv::SIGNATURES,
        misc::SIGNATURES,
        moe_decode::SIGNATURES,
        moe_gemm::SIGNATURES,
        moe_route::SIGNATURES,
        norm::SIGNATURES,
        sample::SIGNATURES,
        trace::SIGNATURES,
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The names of every kernel the launchers know.
#[cfg(test)]
pub(super) fn all_names() -> Vec<&'static str> {
    all_signatures()
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Every `extern "C" __global__` kernel of the sources with its parameters (name, type
    /// without `__restrict__`), macro-generated ones expanded (one level: a `#define` whose
    /// body declares a kernel, and its invocations at the start of a line).
    fn source_kernels() -> BTreeMap<String, Vec<(String, String)>> {
        let mut src = String::new();
        for (_, text) in crate::cuda::SOURCES {
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or("");
                src.push_str(code);
                src.push('\n');
            }
        }
        let src = src.replace("\\\n", " ");
        let mut text = src.clone();
        for line in src.lines() {
            let Some(def) = line.trim_start().strip_prefix("#define ") else {
                continue;
            };
            if !def.contains("__global__") {
                continue;
            }
            let Some((head, body)) = def.split_once(')') else {
                continue;
            };
            let Some((mac, params)) = head.split_once('(') else {
                continue;
            };
            let params: Vec<&str> = params.split(',').map(str::trim).collect();
            for inv in src.lines() {
                let inv = inv.trim();
                let Some(args) = inv
                    .strip_prefix(mac)
                    .and_then(|r| r.strip_prefix('('))
                    .and_then(|r| r.split(')').next())
                else {
                    continue;
                };
                let args: Vec<&str> = args.split(',').map(str::trim).collect();
                let mut b = body.to_string();
                for (p, a) in params.iter().zip(&args) {
                    b = b
                        .replace(&format!("##{p}"), a)
                        .replace(&format!("{p}##"), a);
                    b = replace_word(&b, p, a);
                }
                text.push('\n');
                text.push_str(&b);
            }
        }
        let mut out = BTreeMap::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("extern \"C\" __global__ void") {
            rest = &rest[at + "extern \"C\" __global__ void".len()..];
            // skip attributes: __launch_bounds__(..), __cluster_dims__(..)
            let mut s = rest.trim_start();
            while s.starts_with("__") {
                let close = s.find(')').unwrap();
                s = s[close + 1..].trim_start();
            }
            let open = s.find('(').unwrap();
            let name = s[..open].trim().to_string();
            let close = s[open..].find(')').unwrap() + open;
            let params: Vec<(String, String)> = s[open + 1..close]
                .split(',')
                .map(|p| p.replace("__restrict__", ""))
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let cut = p
                        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .unwrap();
                    let (ty, name) = p.split_at(cut + 1);
                    (name.to_string(), ty.replace(" *", "*").trim().to_string())
                })
                .collect();
            if name.chars().all(|c| c.is_alphanumeric() || c == '_') && !name.contains("NAME") {
                out.insert(name, params);
            }
        }
        out
    }

    fn replace_word(s: &str, word: &str, with: &str) -> String {
        let mut out = String::new();
        let mut rest = s;
        while let Some(i) = rest.find(word) {
            let before = rest[..i].chars().last();
            let after = rest[i + word.len()..].chars().next();
            let boundary = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            out.push_str(&rest[..i]);
            out.push_str(if boundary(before) && boundary(after) {
                with
            } else {
                word
            });
            rest = &rest[i + word.len()..];
        }
        out.push_str(rest);
        out
    }

    /// Every kernel in the CUDA sources has exactly one typed launcher, and its fields are the
    /// kernel's parameters: the same names in the same order, types that pass them.
    #[test]
    fn signatures_match_the_sources() {
        let kernels = source_kernels();
        assert!(
            kernels.contains_key("gemv_dec_stream") && kernels.contains_key("moe_gemm6_m128"),
            "the parser found {:?}",
            kernels.keys().collect::<Vec<_>>()
        );
        let mut covered = std::collections::BTreeSet::new();
        for sig in all_signatures() {
            for &name in sig.names {
                let params = kernels
                    .get(name)
                    .unwrap_or_else(|| panic!("{name}: no such kernel in the sources"));
                assert!(covered.insert(name), "{name}: two launchers");
                let want: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
                let got: Vec<&str> = sig.params.iter().map(|(n, _)| *n).collect();
                assert_eq!(got, want, "{name}: parameter names or order");
                for ((pname, ty), (_, rust)) in params.iter().zip(sig.params) {
                    assert!(
                        rust.contains(&ty.as_str()),
                        "{name}: parameter {pname} is {ty} in CUDA, the launcher passes {rust:?}"
                    );
                }
            }
        }
        let missing: Vec<&String> = kernels
            .keys()
            .filter(|k| !covered.contains(k.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "kernels without a launcher: {missing:?}"
        );
    }

    /// The test's parser is not fooled by a reordered or retyped parameter.
    #[test]
    fn a_reordered_parameter_fails_the_check() {
        let kernels = source_kernels();
        let gates = &kernels["gdn_gates"];
        let sig = gdn_decode::SIGNATURES
            .iter()
            .find(|s| s.names == ["gdn_gates"])
            .unwrap();
        let names: Vec<&str> = sig.params.iter().map(|(n, _)| *n).collect();
        let mut swapped = names.clone();
        swapped.swap(0, 1);
        let src: Vec<&str> = gates.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, src);
        assert_ne!(swapped, src);
        assert!(!<i32 as Param>::CUDA.contains(&"float*"));
    }

    #[test]
    fn views_and_offsets() {
        let d: Dev<f32> = Dev::new(0x1000, 10);
        let e = d.at(4);
        assert_eq!((e.ptr, e.len), (0x1010, 6));
        assert!(Dev::<half::bf16>::null().is_null());
        let ptx =
            ".version 8.5\n.visible .entry gdn_gates(\n\t.param .u64 a\n)\n.visible .entry x_1(\n";
        assert_eq!(ptx_entries(ptx), ["gdn_gates", "x_1"]);
    }
}
