"""The papers' reproduction harness: quality runs (quality, runs), figures (plots), diagnostics
(tools). `python -m experiments quality ...`, `python -m experiments plots`."""
