"""What the server guarantees and how a request is planned against it: `Guarantee` (L as
`call_rows`, the proven widths), its proving state, the `Deployment` that holds it, a request's
`DecodePlan` (the one place its `deterministic` is read) and its `Receipt`."""
