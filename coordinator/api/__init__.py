"""HTTP layer: routes parse requests, call a service, map errors to statuses. Routes never commit."""
