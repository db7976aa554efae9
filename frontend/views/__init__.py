"""The dashboard's views: one module per view, each with its JavaScript beside it where it draws in the page."""
