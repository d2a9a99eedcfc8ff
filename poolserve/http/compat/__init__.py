"""Other families' routes (TEI, Cohere, Infinity): their bodies into jobs, results into their
shapes; no work of their own."""
