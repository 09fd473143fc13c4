"""File names of an exported visual-token folder, shared by the writer and the reader."""

FORMAT = "moonvit-visual-tokens/1"
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.jsonl"
FAILURES_FILE = "failures.jsonl"
PARTS_DIR = "parts"
