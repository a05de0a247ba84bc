"""Our modes against reference baselines (`swiftspec bench`)."""
