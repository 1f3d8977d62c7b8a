"""One table: a row per request that reached a view, so a test can count what really ran."""

from django.db import models


class Hit(models.Model):
    path = models.CharField(max_length=200)
    remaining_ms = models.FloatField()
