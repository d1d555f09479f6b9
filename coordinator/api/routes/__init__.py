from coordinator.api.routes import health, islands, leases, registry, runs

__all__ = ["health", "islands", "leases", "registry", "runs"]
