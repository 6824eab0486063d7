//! `producer completions` and `producer man`: shell completions and man
//! pages generated from the command line's own definition (clap's
//! generators), so they never fall behind a flag.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use clap_complete::Shell;

#[derive(Debug, Args)]
pub struct CompletionsCmd {
    /// bash, zsh, fish, elvish or powershell.
    pub shell: Shell,
}

#[derive(Debug, Args)]
pub struct ManCmd {
    /// Write one page per command here (producer.1, producer-status.1...),
    /// created when absent; without it, producer.1 goes to standard output.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// The completion script of `shell` for the command line `producer`, on
/// standard output.
pub fn completions(cmd: CompletionsCmd, mut producer: clap::Command) -> anyhow::Result<ExitCode> {
    let mut script = Vec::new();
    clap_complete::generate(cmd.shell, &mut producer, "producer", &mut script);
    crate::out!("{}", String::from_utf8_lossy(&script));
    Ok(ExitCode::SUCCESS)
}

/// The man pages of the command line `producer`: the main one on standard
/// output, or every command's into a folder.
pub fn man(cmd: ManCmd, producer: clap::Command) -> anyhow::Result<ExitCode> {
    let Some(dir) = cmd.dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(producer.clone()).render(&mut page)?;
        crate::out!("{}", String::from_utf8_lossy(&page));
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(&dir).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    clap_mangen::generate_to(producer, &dir)
        .map_err(|e| anyhow::anyhow!("cannot write into {}: {e}", dir.display()))?;
    let pages = std::fs::read_dir(&dir)?
        .filter(|e| {
            e.as_ref().is_ok_and(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("producer") && name.ends_with(".1")
            })
        })
        .count();
    common::errln!(
        "{pages} man pages of producer in {}; read one with: man -l {}",
        dir.display(),
        dir.join("producer-status.1").display()
    );
    Ok(ExitCode::SUCCESS)
}
