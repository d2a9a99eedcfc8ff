"""Model loading and native forwards over packed tokens; attention backends."""
