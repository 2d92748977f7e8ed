"""Robust aggregation of the client portions (``robust:``): a device that lies is bounded."""
