"""One thin module per client family: its request shape in, its response shape out."""
