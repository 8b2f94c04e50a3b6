"""dynamod benchmarks: one script per benchmark, each printing a table (or JSON with
`--json`), `--quick` for a smoke run under a minute. `python -m bench.run_all` runs them all.
See docs/benchmarks.md for the latest full results."""
