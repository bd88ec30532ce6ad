"""dprun's command line run in this process (dprun.cli.main(argv)) instead of a `python -m dprun` (~4 s of
imports each): its exit code, stdout and stderr, with a process's environment and folder or under capsys."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

from dprun.cli import main


def environment(cwd, env=None) -> dict[str, str]:
    """What dprun runs with, in a process or in this one: ours without torchrun's PET_* variables, plus `env`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    full_env.update({"COLUMNS": "100", "DPRUN_STATE_DIR": str(cwd / "state"), **(env or {})})
    return full_env


def in_process(args, cwd, env=None) -> tuple[int, str, str]:
    """`dprun ARGS` as dprun.cli.main(ARGS) in this process, in folder `cwd` with the environment a `python -m
    dprun` process is given (environment()): (exit code, stdout, stderr). SystemExit is what the process would
    exit with: a code, or a message the interpreter prints to stderr with exit code 1."""
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(environment(cwd, env))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([*map(str, args)])
                code = 0
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue(), err.getvalue()


def run(capsys, *args: str) -> tuple[int, str, str]:
    """`dprun ARGS` in this process, its output read with pytest's capsys: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    out, err = capsys.readouterr()
    return ended.value.code, out, err
