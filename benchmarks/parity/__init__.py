"""The vLLM parity tool: a corpus of requests (corpus.json), a recorder of normalised answers
(record.py), a comparer (compare.py), the accepted differences (accepted.py) and their page
(docs.py). ``python benchmarks/parity_tool.py --help`` runs them."""
