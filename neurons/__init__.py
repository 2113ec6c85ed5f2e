"""neurons package."""
