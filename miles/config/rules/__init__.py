"""Start-up rules that span sections, one module per feature, each refusal beside the rule it enforces.

Every `check_*` takes the parsed `MilesConfig` and returns one line per problem (the flags, the values
seen and what to change); `miles.config.checks.finalize` runs them all and raises them together.
"""
