//! Load progress: reading the weights into memory, and the progress bar on stderr.

use kestrel::tensor::Mat;
use kestrel::weights::{Mixer, ModelWeights};
use std::time::{Duration, Instant};

/// Every weight matrix of the model (fused experts appear as their per-expert views).
fn matrices(w: &ModelWeights) -> Vec<&Mat> {
    let mut v = vec![&w.embed, &w.lm_head];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Gdn(g) => v.extend([&g.in_qkv, &g.in_z, &g.in_a, &g.in_b, &g.out]),
            Mixer::Attention(a) => v.extend([&a.q, &a.k, &a.v, &a.o]),
        }
        v.push(&l.moe.router);
        for e in l.moe.experts.iter().chain([&l.moe.shared]) {
            v.extend([&e.gate, &e.up, &e.down]);
        }
    }
    v
}

/// Reads every page of the memory-mapped weights once, so they are in memory before the
/// first token, with a progress bar over the bytes read when `show`.
pub(super) fn read_weights(w: &ModelWeights, show: bool) {
    let mats = matrices(w);
    let total: u64 = mats.iter().map(|m| m.nbytes() as u64).sum();
    let mut bar = ProgressBar::new("reading weights", total, show);
    let mut checksum = 0u8;
    for m in mats {
        for chunk in m.bytes().chunks(1 << 20) {
            // One byte per 4 KiB page faults the page in.
            for page in chunk.chunks(4096) {
                checksum ^= page[0];
            }
            bar.advance(chunk.len() as u64);
        }
    }
    std::hint::black_box(checksum);
    bar.finish();
}

pub(super) fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", units[u])
}

/// A one-line progress bar on stderr (bytes, rate); draws nothing when not shown.
pub(super) struct ProgressBar {
    label: &'static str,
    total: u64,
    pub(super) done: u64,
    start: Instant,
    last_draw: Option<Instant>,
    show: bool,
}

impl ProgressBar {
    pub(super) fn new(label: &'static str, total: u64, show: bool) -> Self {
        ProgressBar {
            label,
            total,
            done: 0,
            start: Instant::now(),
            last_draw: None,
            show,
        }
    }

    pub(super) fn advance(&mut self, n: u64) {
        self.done += n;
        if self.show
            && self
                .last_draw
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(100))
        {
            self.draw();
        }
    }

    fn draw(&mut self) {
        self.last_draw = Some(Instant::now());
        let frac = self.done as f64 / self.total.max(1) as f64;
        let width = 30;
        let filled = ((frac * width as f64) as usize).min(width);
        let secs = self.start.elapsed().as_secs_f64();
        let rate = self.done as f64 / secs.max(1e-6);
        let eta = if rate > 0.0 {
            (self.total - self.done) as f64 / rate
        } else {
            0.0
        };
        eprint!(
            "\r\x1b[2K{} [{}{}] {} / {}  {}/s  eta {:.0} s",
            self.label,
            "=".repeat(filled),
            " ".repeat(width - filled),
            human_bytes(self.done),
            human_bytes(self.total),
            human_bytes(rate as u64),
            eta
        );
    }

    pub(super) fn finish(&mut self) {
        let secs = self.start.elapsed().as_secs_f64();
        if self.show {
            self.draw();
            eprintln!(
                "\r\x1b[2K{}: {} in {:.1} s ({}/s)",
                self.label,
                human_bytes(self.total),
                secs,
                human_bytes((self.total as f64 / secs.max(1e-6)) as u64)
            );
        } else {
            tracing::info!(
                "{}: {} in {:.1} s",
                self.label,
                human_bytes(self.total),
                secs
            );
        }
    }
}
