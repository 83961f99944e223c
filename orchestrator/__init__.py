"""thinkpool's orchestration layer: the controller, the REST service, the SDK (``Client``, ``LocalClient``)."""


def __getattr__(name: str):
    # The SDK classes load on first use, so ``import orchestrator.cli`` stays light.
    if name in ("Client", "LocalClient", "solve_tool"):
        from orchestrator import client

        return getattr(client, name)
    raise AttributeError(name)
