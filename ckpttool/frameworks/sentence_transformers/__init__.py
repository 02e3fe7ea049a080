"""sentence-transformers model folders (``SentenceTransformer.save``)."""
