"""The status surface: the HTTP server and its page, `shoal status`, metrics and their ledgers."""
