"""How the `stg` command ends when it does not end well: one line on stderr, never a traceback
or click's usage block.

- an argument click cannot parse (an unknown option, `--dp x`): `error: ...`, exit 2;
- SIGINT (Ctrl-C) or SIGTERM: raised as `Interrupted` in the main thread, so that every
  `finally` and cleanup on the way out runs (a half-written set is removed, a swap in progress
  finishes: stg/outdir.py), then `interrupted (SIGINT)`, exit 128 + the signal's number.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

import typer
from typer.core import TyperGroup

# click's exceptions, from the copy of click that typer runs (newer typers vendor their own)
_click = importlib.import_module(typer.BadParameter.__module__)
_NO_ARGS = getattr(_click, "NoArgsIsHelpError", ())
_ABORT = (typer.Abort, getattr(_click, "Abort", typer.Abort))


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; a BaseException so that no `except Exception` swallows it."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = number


def _raise(number: int, _frame) -> None:
    raise Interrupted(number)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class OneLineGroup(TyperGroup):
    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        previous = {sig: signal.signal(sig, _raise) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS as error:  # `stg` alone: the help, as click prints it
            error.show()
            code = error.exit_code
        except _click.ClickException as error:
            where = f" (see {error.ctx.command_path} --help)" if getattr(error, "ctx", None) else ""
            typer.echo(f"error: {_one_line(error.format_message())}{where}", err=True)
            code = 2
        except _ABORT:
            code = 1
        except (Interrupted, KeyboardInterrupt) as error:
            number = getattr(error, "number", signal.SIGINT)
            typer.echo(f"interrupted ({signal.Signals(number).name})", err=True)
            code = 128 + number
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        sys.exit(code if isinstance(code, int) else 0)
