"""What differs between transformers releases that the tests and benchmarks drive."""


def cache_keyword(model) -> str:
    """The name the model's forward (and generate, and the output) give the
    cache: `cache` from transformers 5.24 on (which warns at
    `past_key_values`), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
