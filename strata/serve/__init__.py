"""OpenAI-compatible HTTP serving: `create_app(engine, model_name, ...)`, and `strata serve`."""


def __getattr__(name):  # fastapi is imported only when the app is wanted
    if name == "create_app":
        from strata.serve.app import create_app

        return create_app
    raise AttributeError(name)
