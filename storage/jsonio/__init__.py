"""JSON as every record is written and read: canonical JSON (the one encoding of records, digest inputs and state files) and the bounded parser.

Cross-cutting: any room may import it; it imports only storage.errors.
"""
