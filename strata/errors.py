"""User-facing errors: one line that names the problem and, where there is one, the fix."""


class StrataError(Exception):
    """An error caused by input (a file, a flag, a prompt); the CLI prints it and exits 2."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} ({fix})" if fix else problem)


class UnsupportedQuantType(StrataError):
    pass


class BadModelFile(StrataError):
    pass


class BadOption(StrataError):
    pass
