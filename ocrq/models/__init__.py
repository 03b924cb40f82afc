"""OCR engines behind one small interface. Nothing here knows about Celery or the database."""
