"""Reports, dumps and pictures of what the backend did. Reads results; never changes a graph."""
