#!/usr/bin/env python3
"""Runs a command in a pseudo-terminal and types into it, as a person would.

usage: drive.py INPUT [INPUT...] -- COMMAND [ARGS...]
Each INPUT (one key, or a line of text ending with a newline) is sent once
the program has printed its next prompt (`> `); the INPUT `<HUP>` hangs the
terminal up instead (SIGHUP to the program, as when its window closes). Prints everything the
program wrote; exits with its exit code.
"""
import os
import pty
import select
import signal
import sys
import time


def main():
    sep = sys.argv.index("--")
    inputs, cmd = sys.argv[1:sep], sys.argv[sep + 1:]
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp(cmd[0], cmd)
    out = b""
    pending = list(inputs)
    deadline = time.time() + 60
    prompts_seen = 0
    while time.time() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        if pending and out.count(b"> ") > prompts_seen:
            prompts_seen = out.count(b"> ")
            key = pending.pop(0)
            if key == "<HUP>":
                os.kill(pid, signal.SIGHUP)
            else:
                os.write(fd, key.encode())
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(out.decode(errors="replace"))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
