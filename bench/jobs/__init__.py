"""Batch jobs: `poolserve embed` against its engine (`bench embed-job`), Ray Data across actors
(`bench ray-embed`)."""
