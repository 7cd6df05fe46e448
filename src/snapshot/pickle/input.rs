//! The decoder's input, read in pieces (the file is never held whole), with its bound on
//! bytes read.

use std::io::Read;

use super::arena::{DecodeError, Result};

/// Longest text argument (`INT`, `LONG`, `FLOAT`, `PUT`, `GET`) accepted.
const MAX_TEXT_LINE: usize = 80;

/// The input, read in pieces.
pub(super) struct Input<R> {
    src: R,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// Bytes read from `src` so far.
    read: u64,
    limit: u64,
    gzip: bool,
    eof: bool,
}

impl<R: Read> Input<R> {
    /// `src` read in pieces of `capacity` bytes, at most `limit` bytes in all; `gzip` says
    /// whether read errors come from a gzip decoder.
    pub(super) fn new(src: R, capacity: usize, limit: u64, gzip: bool) -> Input<R> {
        Input {
            src,
            buf: vec![0u8; capacity].into_boxed_slice(),
            pos: 0,
            end: 0,
            read: 0,
            limit,
            gzip,
            eof: false,
        }
    }

    /// Offset of the next byte.
    pub(super) fn offset(&self) -> u64 {
        self.read - (self.end - self.pos) as u64
    }

    /// Refills the buffer; `false` at the end of the input.
    pub(super) fn fill(&mut self) -> Result<bool> {
        if self.eof {
            return Ok(false);
        }
        loop {
            match self.src.read(&mut self.buf) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.pos = 0;
                    self.end = n;
                    self.read += n as u64;
                    if self.read > self.limit {
                        return Err(DecodeError::TooLarge(if self.gzip {
                            format!("it decompresses to more than {} bytes", self.limit)
                        } else {
                            format!("the input is larger than {} bytes", self.limit)
                        }));
                    }
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if self.gzip && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Err(DecodeError::Truncated("the gzip stream ends early".into()));
                }
                Err(e) if self.gzip => {
                    return Err(DecodeError::NotPickle(format!(
                        "gzip magic bytes, but not a valid gzip stream: {e}"
                    )));
                }
                Err(e) => return Err(DecodeError::Io(e)),
            }
        }
    }

    pub(super) fn truncated(&self, what: &str) -> DecodeError {
        DecodeError::Truncated(format!(
            "the input ends at byte {} inside {what}",
            self.offset()
        ))
    }

    #[inline(always)]
    pub(super) fn byte(&mut self, what: &str) -> Result<u8> {
        if self.pos == self.end && !self.fill()? {
            return Err(self.truncated(what));
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(b)
    }

    #[inline(always)]
    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        if self.end - self.pos >= N {
            out.copy_from_slice(&self.buf[self.pos..self.pos + N]);
            self.pos += N;
        } else {
            for b in &mut out {
                *b = self.byte(what)?;
            }
        }
        Ok(out)
    }

    /// Reads `n` bytes into `out` (cleared first), growing it only as the data arrives.
    pub(super) fn bytes(&mut self, n: u64, out: &mut Vec<u8>, what: &str) -> Result<()> {
        out.clear();
        let mut left = n;
        while left > 0 {
            if self.pos == self.end && !self.fill()? {
                return Err(self.truncated(what));
            }
            let take = (self.end - self.pos).min(usize::try_from(left).unwrap_or(usize::MAX));
            out.extend_from_slice(&self.buf[self.pos..self.pos + take]);
            self.pos += take;
            left -= take as u64;
        }
        Ok(())
    }

    /// A text argument up to its newline.
    pub(super) fn line(&mut self, out: &mut Vec<u8>, what: &str) -> Result<()> {
        out.clear();
        loop {
            let b = self.byte(what)?;
            if b == b'\n' {
                return Ok(());
            }
            if out.len() >= MAX_TEXT_LINE {
                return Err(DecodeError::NotPickle(format!(
                    "the text argument of {what} is longer than {MAX_TEXT_LINE} bytes"
                )));
            }
            out.push(b);
        }
    }

    /// Whether the input has ended (reading on to its end, so gzip checks its trailer).
    pub(super) fn at_end(&mut self) -> Result<bool> {
        if self.pos < self.end {
            return Ok(false);
        }
        Ok(!self.fill()?)
    }
}
