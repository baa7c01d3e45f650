//! (filled in by the tests that use it)
