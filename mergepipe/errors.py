"""Error types: each maps to an exit code and prints as one line that says what went
wrong, where, and how to fix it.

`cli.main` (and `mergepipe demo`'s own main, and the Snakemake rules) print them;
below the CLI they are caught only to turn one into another with more context
(a unit error into a config key's error) or to treat a damaged cache entry or
stored merge as absent."""


class MergepipeError(Exception):
    exit_code = 1


class ConfigError(MergepipeError):
    """Bad params.yaml / CLI arguments / mergekit config."""

    exit_code = 2


class CheckpointError(MergepipeError):
    """Malformed, hostile or mismatched checkpoint (file and tensor named)."""

    exit_code = 3


class BudgetError(MergepipeError):
    """The budget cannot be honoured (a budget that does not parse is a ConfigError: units.UnitError)."""

    exit_code = 4


class MethodError(MergepipeError):
    """A merge method cannot run with these parameters or inputs."""

    exit_code = 5


class IntegrityError(MergepipeError):
    """Bytes on disk do not match their recorded hash (tampering, corruption, stale index)."""

    exit_code = 6


class OutputError(MergepipeError):
    """The output location is unusable (is an input, is a file, is locked, disk full)."""

    exit_code = 7


class MissingInputError(MergepipeError):
    """`audit`: an input the manifest records was found nowhere it looked (the merge is neither
    proven nor disproven; a found input that differs is an IntegrityError)."""

    exit_code = 8
