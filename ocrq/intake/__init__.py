"""Bytes to images and documents: fetch (the address policy), image decoding, documents, page
splitting. The security surface of a worker."""
