from coordinator.api.routes import dashboard, health, islands, leases, registry, runs, ui

__all__ = ["dashboard", "health", "islands", "leases", "registry", "runs", "ui"]
