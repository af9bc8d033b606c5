"""Trust: blocked terms, the safety checker, AI-content marks and C2PA signing."""
