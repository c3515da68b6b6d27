"""Adapters to outside formats: each module maps one family's names to editmerge's, with its
source."""
