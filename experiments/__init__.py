"""The papers' reproduction harness: quality runs (quality, runs), their numbers (metrics), paper A's
experiment 5 (cast), figures (plots), diagnostics (tools). `python -m experiments quality ...`,
`python -m experiments plots`, `python -m experiments.tools ...`."""
