"""A training command as Python runs it: the interpreter, its flags, and the target.

``phalanx run`` needs to know what a command would run, without running it:

- to start it warm, from a fork server that already imported torch
  (:mod:`phalanx.runtime.zygote`), the command must be this shape:
  ``PYTHON [FLAGS] script.py ARGS``, ``PYTHON [FLAGS] -m module ARGS`` or
  ``PYTHON [FLAGS] -c CODE ARGS`` (:func:`parse`; anything else -- a shell script, a
  binary -- starts cold, as a plain process);
- to choose how a fault is recovered, whether the script uses Phalanx at all
  (:func:`uses_phalanx`): a script that never imports ``phalanx`` is an unmodified
  torchrun script, whose workers restart on every membership change.

>>> parse(["python3", "-u", "train.py", "--lr", "3e-4"])
Target(interpreter='python3', flags=('-u',), kind='script', value='train.py', args=('--lr', '3e-4'))
>>> parse(["python", "-m", "pkg.train", "x"]).argv0
'pkg.train'
>>> parse(["bash", "run.sh"]) is None
True
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import re
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["Outcome", "Target", "parse", "run_target", "uses_phalanx"]

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
# Interpreter flags a warm start reproduces (the fork server starts with them);
# those that take a value take it as the next argument.
_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-P"})
_VALUED = frozenset({"-X", "-W"})
MAX_SOURCE_BYTES = 8 << 20  # a script bigger than this is not read to look for imports


@dataclass(frozen=True)
class Target:
    """What ``interpreter`` runs: a ``script`` path, a ``module`` name or ``code``."""

    interpreter: str
    flags: tuple[str, ...]
    kind: Literal["script", "module", "code"]
    value: str
    args: tuple[str, ...]

    @property
    def argv0(self) -> str:
        """``sys.argv[0]`` as Python sets it (a module's is its path once found; its name here)."""
        return {"script": self.value, "module": self.value, "code": "-c"}[self.kind]

    def python_args(self) -> list[str]:
        """The arguments after the interpreter's flags: ``[script, *args]``, ``["-m", module, *args]``."""
        head = {"script": [self.value], "module": ["-m", self.value], "code": ["-c", self.value]}[self.kind]
        return [*head, *self.args]


def parse(cmd: list[str]) -> Target | None:
    """The :class:`Target` of ``cmd``, or None when it is not a Python command run this way."""
    if not cmd or not _PYTHON.match(Path(cmd[0]).name):
        return None
    flags: list[str] = []
    i = 1
    while i < len(cmd):
        a = cmd[i]
        if a in _FLAGS:
            flags.append(a)
        elif a in _VALUED and i + 1 < len(cmd):
            flags += [a, cmd[i + 1]]
            i += 1
        elif a in ("-m", "-c") and i + 1 < len(cmd):
            kind: Literal["module", "code"] = "module" if a == "-m" else "code"
            return Target(cmd[0], tuple(flags), kind, cmd[i + 1], tuple(cmd[i + 2 :]))
        elif a.startswith("-") or a == "":
            return None  # a flag we do not reproduce (or stdin): start it as it is
        else:
            return Target(cmd[0], tuple(flags), "script", a, tuple(cmd[i + 1 :]))
        i += 1
    return None


def _source(target: Target, cwd: Path) -> str | None:
    if target.kind == "code":
        return target.value
    if target.kind == "script":
        path = cwd / target.value
    else:
        sys.path.insert(0, str(cwd))  # as `python -m` searches: the working directory first
        try:
            spec = importlib.util.find_spec(target.value)  # imports the parent packages only
        except (ImportError, ValueError):
            return None
        finally:
            sys.path.remove(str(cwd))
        if spec is None or not spec.origin or not spec.has_location:
            return None
        path = Path(spec.origin)
        if path.name == "__init__.py":
            path = path.with_name("__main__.py")
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


def uses_phalanx(target: Target, cwd: Path | None = None) -> bool | None:
    """Whether the target's own source imports ``phalanx`` (None: its source cannot be read
    or parsed). Only the target itself is read, not what it imports: a script whose own
    module imports Phalanx for it should say so with ``phalanx run --recovery in-process``."""
    source = _source(target, cwd or Path(os.getcwd()))
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "phalanx" for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "phalanx"
        ):
            return True
    return False


@dataclass(frozen=True)
class Outcome:
    """How a target ended in this process: its exit code, and the exception that ended
    it (None for a return or ``sys.exit``)."""

    code: int
    error: BaseException | None = None

    @property
    def at_start(self) -> bool:
        """It could not start: an import or syntax error, or a script that is not there.
        The same in every process of the job, so restarting it is a loop, not a recovery."""
        return isinstance(self.error, ImportError | SyntaxError | _Missing)


class _Missing(OSError):
    """The script cannot be opened."""


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message"), as Python does it
    return 1


def run_target(target: Target) -> Outcome:
    """Run ``target`` in this process as ``python [flags] target...`` would run it as
    ``__main__``: ``sys.argv`` and ``sys.path[0]`` set as Python sets them; an uncaught
    exception printed and exit code 1, ``sys.exit(code)`` its code."""
    try:
        if target.kind == "script":
            path = os.path.abspath(target.value)
            if not os.path.isfile(path):
                raise _Missing(f"can't open file {path!r}: no such file")
            sys.argv = [target.value, *target.args]
            sys.path[0] = os.path.dirname(path)
            runpy.run_path(path, run_name="__main__")
        elif target.kind == "module":
            sys.argv = [target.value, *target.args]  # runpy puts the module's path in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(target.value, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *target.args]
            sys.path[0] = ""
            code = compile(target.value, "<string>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        return Outcome(_exit_code(exc))
    except KeyboardInterrupt as exc:
        traceback.print_exc()
        return Outcome(130, exc)
    except _Missing as exc:
        print(f"{target.interpreter}: {exc}", file=sys.stderr)
        return Outcome(2, exc)
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return Outcome(1, exc)
    return Outcome(0)
