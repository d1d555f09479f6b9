"""Plain functions that own a transaction each: they take a Session, commit, and raise ServiceError."""
