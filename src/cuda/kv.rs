//! The KV cache in pages, through the driver's virtual memory management (the vAttention
//! way): each sequence reserves a virtual range of `max_seq` positions for every attention
//! layer's K and V, and physical pages of [`KV_PAGE_BYTES`] (2,048 positions of the model's
//! 2 KV heads of 256 dims) are mapped into it as the sequence grows. Memory therefore follows
//! the positions a sequence holds, while the attention kernels, the batch tables and the
//! captured decode graphs keep seeing one contiguous cache a layer (no block table in the
//! kernels). A snapshot maps its source's full pages again, shared by reference, and copies
//! only the last, partly filled one; a page goes back to the pool when its last holder drops.

use super::kernels::Dev;
use super::{Gpu, GpuError};
use anyhow::{Result, bail, ensure};
use cudarc::driver::sys;
use std::sync::{Arc, Mutex};

/// Bytes of one KV page (one layer's K or V): the driver's allocation granularity on Hopper.
pub const KV_PAGE_BYTES: usize = 2 << 20;

/// Released pages the pool keeps for reuse; beyond that they go back to the driver, so that
/// memory a burst of long sequences took is free again for whatever comes next.
const KEEP_FREE_PAGES: usize = 64;

/// Physical KV pages: created on demand, reused, counted.
pub struct KvPool {
    gpu: Arc<Gpu>,
    inner: Mutex<PoolInner>,
}

#[derive(Default)]
struct PoolInner {
    free: Vec<sys::CUmemGenericAllocationHandle>,
    /// Pages mapped by some sequence state or snapshot now.
    in_use: usize,
}

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

fn prop(device: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its documented default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p
}

fn driver(op: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(GpuError::driver(op)).map_err(Into::into)
}

impl KvPool {
    /// The pool of `gpu`'s device; an error where its allocation granularity does not divide
    /// [`KV_PAGE_BYTES`].
    pub fn new(gpu: Arc<Gpu>) -> Result<Arc<KvPool>> {
        gpu.bind()?;
        let p = prop(gpu.device());
        let mut gran = 0usize;
        // SAFETY: valid out pointer and property.
        driver("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        ensure!(
            gran > 0 && KV_PAGE_BYTES.is_multiple_of(gran),
            "the GPU's memory mapping granularity is {gran} bytes, which does not divide the KV page of {KV_PAGE_BYTES}"
        );
        Ok(Arc::new(KvPool {
            gpu,
            inner: Mutex::new(PoolInner::default()),
        }))
    }

    /// Pages held by sequence states and snapshots now.
    pub fn pages_in_use(&self) -> usize {
        self.inner.lock().unwrap().in_use
    }

    fn take(self: &Arc<Self>) -> Result<Page> {
        let reused = {
            let mut i = self.inner.lock().unwrap();
            let h = i.free.pop();
            if h.is_some() {
                i.in_use += 1;
            }
            h
        };
        let handle = match reused {
            Some(h) => h,
            None => {
                let mut h = 0;
                let p = prop(self.gpu.device());
                // SAFETY: valid out pointer and property; released in `put` or `drop`.
                unsafe { sys::cuMemCreate(&mut h, KV_PAGE_BYTES, &p, 0) }
                    .result()
                    .map_err(|e| GpuError::OutOfMemory {
                        bytes: KV_PAGE_BYTES,
                        driver: format!("{e:?} (a KV page)"),
                    })?;
                self.inner.lock().unwrap().in_use += 1;
                h
            }
        };
        Ok(Page {
            handle,
            pool: self.clone(),
        })
    }

    fn put(&self, handle: sys::CUmemGenericAllocationHandle) {
        let mut i = self.inner.lock().unwrap();
        i.in_use -= 1;
        if i.free.len() < KEEP_FREE_PAGES {
            i.free.push(handle);
        } else {
            drop(i);
            let _ = self.gpu.bind();
            // SAFETY: the handle came from cuMemCreate and is no longer mapped anywhere.
            unsafe {
                let _ = sys::cuMemRelease(handle);
            }
        }
    }
}

impl Drop for KvPool {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for h in self.inner.get_mut().unwrap().free.drain(..) {
            // SAFETY: free handles are mapped nowhere.
            unsafe {
                let _ = sys::cuMemRelease(h);
            }
        }
    }
}

/// One physical page; back to its pool when the last mapping that holds it goes.
struct Page {
    handle: sys::CUmemGenericAllocationHandle,
    pool: Arc<KvPool>,
}

impl Drop for Page {
    fn drop(&mut self) {
        self.pool.put(self.handle);
    }
}

/// A sequence's K and V caches: `ranges` contiguous virtual ranges of `span` bytes (layer i's
/// K is range 2i, its V 2i + 1), each backed by physical pages up to the positions held.
pub struct PagedKv {
    pool: Arc<KvPool>,
    base: u64,
    span: usize,
    token_bytes: usize,
    /// The pages mapped into each range, in order.
    pages: Vec<Vec<Arc<Page>>>,
}

impl PagedKv {
    /// Room for `max_tokens` positions of `token_bytes` in `ranges` ranges, no page mapped yet.
    pub fn new(
        pool: &Arc<KvPool>,
        ranges: usize,
        max_tokens: usize,
        token_bytes: usize,
    ) -> Result<PagedKv> {
        ensure!(
            token_bytes > 0 && KV_PAGE_BYTES.is_multiple_of(token_bytes),
            "a KV position of {token_bytes} bytes does not divide the KV page of {KV_PAGE_BYTES}"
        );
        let span = (max_tokens * token_bytes).div_ceil(KV_PAGE_BYTES) * KV_PAGE_BYTES;
        let mut base = 0;
        if ranges > 0 && span > 0 {
            pool.gpu.bind()?;
            // SAFETY: valid out pointer; freed in drop.
            driver("cuMemAddressReserve", unsafe {
                sys::cuMemAddressReserve(&mut base, ranges * span, KV_PAGE_BYTES, 0, 0)
            })?;
        }
        Ok(PagedKv {
            pool: pool.clone(),
            base,
            span,
            token_bytes,
            pages: (0..ranges).map(|_| Vec::new()).collect(),
        })
    }

    /// Positions a page holds.
    pub fn page_tokens(&self) -> usize {
        KV_PAGE_BYTES / self.token_bytes
    }

    /// The device address of range `r` (layer i's K: 2i, V: 2i + 1).
    pub fn ptr(&self, r: usize) -> u64 {
        self.base + (r * self.span) as u64
    }

    /// Range `r` as bf16 elements.
    pub fn range(&self, r: usize) -> Dev<half::bf16> {
        Dev::new(self.ptr(r), self.span / 2)
    }

    /// Positions backed by pages in every range.
    pub fn mapped_tokens(&self) -> usize {
        self.pages.first().map_or(usize::MAX, |p| p.len()) * self.page_tokens()
    }

    /// Pages this cache maps (some may be shared with snapshots).
    pub fn pages_held(&self) -> usize {
        self.pages.iter().map(Vec::len).sum()
    }

    fn map(&mut self, r: usize, page: Arc<Page>) -> Result<()> {
        let at = self.ptr(r) + (self.pages[r].len() * KV_PAGE_BYTES) as u64;
        ensure!(
            (self.pages[r].len() + 1) * KV_PAGE_BYTES <= self.span,
            "KV range {r} is full"
        );
        let access = sys::CUmemAccessDesc {
            location: location(self.pool.gpu.device()),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `at` is page-aligned inside our reservation and not mapped yet.
        driver("cuMemMap", unsafe {
            sys::cuMemMap(at, KV_PAGE_BYTES, 0, page.handle, 0)
        })?;
        // SAFETY: the page just mapped.
        if let Err(e) = driver("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(at, KV_PAGE_BYTES, &access, 1)
        }) {
            // SAFETY: mapped just above.
            unsafe {
                let _ = sys::cuMemUnmap(at, KV_PAGE_BYTES);
            }
            return Err(e);
        }
        self.pages[r].push(page);
        Ok(())
    }

    /// Backs positions `0..tokens` with pages in every range.
    pub fn ensure(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.span / self.token_bytes {
            bail!(
                "{tokens} KV positions asked of a cache reserved for {}",
                self.span / self.token_bytes
            );
        }
        self.pool.gpu.bind()?;
        let need = tokens.div_ceil(self.page_tokens());
        for r in 0..self.pages.len() {
            while self.pages[r].len() < need {
                let page = Arc::new(self.pool.take()?);
                self.map(r, page)?;
            }
        }
        Ok(())
    }

    /// A copy holding positions `0..len`: the full pages shared, the partly filled last one
    /// copied. Its reservation is as large as this one's.
    pub fn snapshot(&self, gpu: &Gpu, len: usize) -> Result<PagedKv> {
        let mut s = PagedKv::new(
            &self.pool,
            self.pages.len(),
            self.span / self.token_bytes,
            self.token_bytes,
        )?;
        let (full, rest) = (len / self.page_tokens(), len % self.page_tokens());
        ensure!(
            full + usize::from(rest > 0) <= self.pages.first().map_or(0, Vec::len),
            "a snapshot of {len} positions from a cache that maps {}",
            self.mapped_tokens()
        );
        for r in 0..self.pages.len() {
            for page in &self.pages[r][..full] {
                s.map(r, page.clone())?;
            }
            if rest > 0 {
                s.map(r, Arc::new(self.pool.take()?))?;
                let off = (full * KV_PAGE_BYTES) as u64;
                gpu.copy_device(s.ptr(r) + off, self.ptr(r) + off, rest * self.token_bytes)?;
            }
        }
        Ok(s)
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        if self.base == 0 {
            return;
        }
        let (g, ranges) = (&self.pool.gpu, self.pages.len());
        let _ = g.bind();
        // Kernels still queued may read these pages: they finish before the pages can be
        // mapped elsewhere.
        let _ = g.sync();
        for r in 0..ranges {
            for k in 0..self.pages[r].len() {
                let at = self.ptr(r) + (k * KV_PAGE_BYTES) as u64;
                // SAFETY: mapped by `map`, unmapped once.
                unsafe {
                    let _ = sys::cuMemUnmap(at, KV_PAGE_BYTES);
                }
            }
        }
        self.pages.clear();
        // SAFETY: reserved in `new` with this size; nothing is mapped in it any more.
        unsafe {
            let _ = sys::cuMemAddressFree(self.base, self.span * ranges);
        }
    }
}
