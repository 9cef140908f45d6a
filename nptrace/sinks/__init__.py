"""Where verdicts go. Every sink has write(verdict) and close(); none of them classifies."""
