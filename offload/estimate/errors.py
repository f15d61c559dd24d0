"""The estimator's error type."""


class EstimateError(ValueError):
    """A bad input to the estimator: names the option or key, the value and what is allowed."""
