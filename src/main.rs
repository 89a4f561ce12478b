//! The `kestrel` command line: `generate`, `chat`, `serve`, `inspect` and `bench`.
//!
//! The commands live in [`cli`].

mod cli;

fn main() {
    cli::main()
}
