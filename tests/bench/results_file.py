"""A made-up tailserve-load results.jsonl for the bench/serving tools' tests."""
import json
import os
import tempfile
import unittest


def write_results(records):
    """The records as a results.jsonl in a temporary file; the caller removes it."""
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False) as f:
        for r in records:
            f.write(json.dumps(r) + '\n')
    return f.name


class ResultsFileTest(unittest.TestCase):
    """Writes the subclass's RECORDS to self.path before each test and removes it after."""
    RECORDS = []

    def setUp(self):
        self.path = write_results(self.RECORDS)

    def tearDown(self):
        os.unlink(self.path)
