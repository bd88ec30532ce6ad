"""Code the tests share (no tests here): one module per job, imported as `helpers.<module>` from tests/ (pytest
puts tests/ on sys.path for conftest.py, as `from conftest import ...` relies on); no test module imports another."""
