"""Text rendering: OCR of the quoted target."""
