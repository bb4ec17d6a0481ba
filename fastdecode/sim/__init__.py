"""`fastdecode simulate`: a discrete-event model of one job (docs/simulate.md)."""
