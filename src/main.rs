//! The `cube-adapter` binary. Everything, the command line included, lives
//! in the library (`cube_adapter::cli`).

fn main() -> std::process::ExitCode {
    cube_adapter::cli::run()
}
