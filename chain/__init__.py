"""chain package."""
