"""The commands a run's processes are started with, one module each: `primerl COMMAND` (or `python -m primerl
COMMAND`; under torchrun, `-m primerl.entrypoints.trainer`). They sit on top of the packages they put together and
nothing below imports them (docs/architecture.md, "Layers"); `primerl train`, `compare`, `replay` and `rerun` are
the top-level modules beside this package."""
