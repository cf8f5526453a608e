"""The argument parser every `strata` command uses: a bad flag is one line and exit 2, like any bad input.

argparse's own `error()` prints the whole usage block before its message; a user who mistyped one
flag needs the message, and `--help` has the rest.
"""

from __future__ import annotations

import argparse

from strata.errors import BadOption


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BadOption(message, f"see {self.prog} --help")
