#!/usr/bin/env python3
"""Walks docs/deploy.md in dry-run mode: prints every command it gives for pd-bootstrap's
programs, vLLM and run-pd.sh, and checks that each exists with the flags it is given.

    check_deploy_guide.py --bin-dir target/debug [--vllm-python PYTHON] [--guide docs/deploy.md]

- Commands are read from the guide's ```sh blocks (lines joined at a trailing backslash) and
  from its inline code that starts with a program's name.
- bootstrap-server, pd-proxy, worker-client: every `--flag` must be in the program's `--help`
  (worker-client's subcommand's too); a subcommand must exist.
- `vllm serve`: with --vllm-python, every flag must be in the help of vLLM's OpenAI server
  (`python -m vllm.entrypoints.openai.api_server --help`); without it, vLLM's lines are listed
  and not checked.
- run-pd.sh: the subcommand must be one the script knows, and its bootstrap command, printed
  with DRY_RUN=1, must check as above.
- The settings table: a row naming one of the programs lists only flags it has.

Exit 0 when everything checks, 1 with each problem on stderr.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("bootstrap-server", "pd-proxy", "worker-client")


def commands(guide: str):
    """Every command of the guide: (where, text, words, parse error, whether it is only an
    inline mention, which may leave out the subcommand)."""
    found = []
    for block in re.finditer(r"```sh\n(.*?)```", guide, re.S):
        line_no = guide[: block.start()].count("\n") + 2
        text = re.sub(r"\\\n\s*", " ", block.group(1))
        pending = ""
        for line in text.splitlines():
            line = line.strip()
            # `# or: run-pd.sh ...` gives the same step through the script.
            line = re.sub(r"^#\s*or:\s*", "", line)
            if not pending and (not line or line.startswith("#")):
                continue
            pending = f"{pending} {line}".strip()
            try:
                shlex.split(pending)
            except ValueError:
                continue  # a quoted argument goes on on the next line
            found.append((f"line {line_no}", pending, False))
            pending = ""
        if pending:
            found.append((f"line {line_no}", pending, False))
    for span in re.finditer(r"`([^`\n]+)`", guide):
        text = span.group(1)
        if text.split(" ", 1)[0] in OURS and " " in text:
            found.append((f"line {guide[: span.start()].count(chr(10)) + 1}", text, True))
    parsed = []
    for where, line, mention in found:
        # Only the command: what follows `#` or `&&` is commentary or another step.
        line = re.split(r"\s+#\s|\s&&\s|\s\|\|\s", line)[0]
        try:
            words = shlex.split(line)
        except ValueError as err:
            parsed.append((where, line, None, str(err), mention))
            continue
        # Leading VAR=value assignments and `env` set the environment, not the command.
        while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] == "env"):
            words = words[1:]
        # A line of flags alone adds to the `vllm serve` before it ("the same, plus").
        if words and words[0].startswith("--") and not mention:
            words = ["vllm", "serve", "MODEL", *words]
        parsed.append((where, line, words, None, mention))
    return parsed


def flags(words):
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


class Helps:
    """The `--help` of each program (and subcommand), asked once."""

    def __init__(self, bin_dir: Path, vllm_python):
        self.bin_dir = bin_dir
        self.vllm_python = vllm_python
        self.cache = {}

    def of(self, *argv):
        if argv not in self.cache:
            program = argv[0]
            if program == "vllm":
                cmd = [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--help"]
            else:
                cmd = [str(self.bin_dir / program), *argv[1:], "--help"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.cache[argv] = (done.returncode, done.stdout + done.stderr)
        return self.cache[argv]


def check_ours(words, helps, problems, where, mention=False):
    program = words[0]
    code, text = helps.of(program)
    if code != 0:
        problems.append(f"{where}: {program} --help failed: {text[-300:]}")
        return
    args = words[1:]
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
    if program == "worker-client":
        subcommands = re.findall(r"^\s{2}([a-z][a-z-]+)\s", text.split("Commands:", 1)[-1], re.M)
        # Global flags with a value come before the subcommand.
        i = 0
        while i < len(args) and args[i].startswith("--"):
            i += 1 if "=" in args[i] else 2
        named = args[i] if i < len(args) and args[i] in subcommands else None
        if named is None and not mention:
            problems.append(f"{where}: worker-client has no subcommand in {' '.join(words)!r}")
            return
        # A mention without its subcommand: the flag of any subcommand will do.
        for sub in [named] if named else [s for s in subcommands if s != "help"]:
            known |= set(re.findall(r"--[a-z0-9][a-z0-9-]*", helps.of(program, sub)[1]))
    for flag in flags(args):
        if flag not in known:
            problems.append(f"{where}: {program} has no {flag}")


def check_vllm(words, helps, problems, where):
    if not helps.vllm_python:
        return "not checked (no --vllm-python)"
    code, text = helps.of("vllm")
    if code != 0:
        problems.append(f"{where}: vLLM's --help failed: {text[-300:]}")
        return None
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
    for flag in flags(words[2:]):
        if flag not in known:
            problems.append(f"{where}: vllm serve has no {flag}")
    return None


def check_run_pd(words, problems, where, helps):
    script = ROOT / "examples/vllm/run-pd.sh"
    known = re.findall(r"^\s+([a-z-]+)\) cmd_", script.read_text(), re.M)
    sub = next((w for w in words[1:] if not w.startswith("-")), None)
    if sub not in known:
        problems.append(f"{where}: run-pd.sh has no subcommand {sub!r} (it has {known})")
        return
    if sub == "bootstrap":
        env = dict(os.environ, DRY_RUN="1", BIN_DIR=str(helps.bin_dir), P_HOST="127.0.0.1")
        done = subprocess.run(["bash", str(script), "bootstrap"], capture_output=True,
                              text=True, env=env, timeout=60)
        if done.returncode != 0:
            problems.append(f"{where}: run-pd.sh bootstrap (dry run) failed: {done.stderr[-300:]}")
            return
        printed = shlex.split(done.stdout.strip().splitlines()[-1])
        printed[0] = Path(printed[0]).name
        print(f"    run-pd.sh bootstrap would run: {' '.join(printed)}")
        check_ours(printed, helps, problems, f"{where} (run-pd.sh bootstrap)")


def check_settings_table(guide, helps, problems):
    for row in re.finditer(r"^\| ([a-z-]+) \| (.*)$", guide, re.M):
        program = row.group(1)
        if program not in OURS:
            continue
        line = guide[: row.start()].count("\n") + 1
        # The row's first code cells name the program's flags.
        cells = row.group(2).split(" | ")
        named = re.findall(r"`(--[a-z0-9-]+)", cells[0])
        check_ours([program, *named], helps, problems, f"line {line} (settings table)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", type=Path, required=True)
    parser.add_argument("--vllm-python")
    parser.add_argument("--guide", type=Path, default=ROOT / "docs/deploy.md")
    args = parser.parse_args()
    guide = args.guide.read_text()
    helps = Helps(args.bin_dir, args.vllm_python)
    problems = []
    walked = 0
    for where, line, words, error, mention in commands(guide):
        if words is None:
            problems.append(f"{where}: cannot parse {line!r}: {error}")
            continue
        if not words:
            continue
        program = Path(words[0]).name
        note = None
        if program in OURS:
            check_ours([program, *words[1:]], helps, problems, where, mention)
        elif program == "vllm" and words[1:2] == ["serve"]:
            note = check_vllm(words, helps, problems, where)
        elif program == "run-pd.sh":
            check_run_pd(words, problems, where, helps)
        else:
            continue
        walked += 1
        print(f"{where}: {' '.join(words)}" + (f"  [{note}]" if note else ""))
    check_settings_table(guide, helps, problems)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print(f"{walked} commands walked, {len(problems)} problems")
    return 1 if problems or walked < 10 else 0


if __name__ == "__main__":
    sys.exit(main())
