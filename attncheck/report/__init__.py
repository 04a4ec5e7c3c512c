"""Records, their merge into a report with a verdict, and its rendering."""

DEFAULT_DIR = "reports/latest"
