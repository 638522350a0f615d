/* gpucache's optional compiled part: plain C against the libjpeg API, called through ctypes
 * (gpucache/decode/_roi.py, _roi_rst.py), so no Python headers are needed.
 *
 * gc_decode_region: decode only a box of a JPEG (libjpeg-turbo's jpeg_crop_scanline and
 * jpeg_skip_scanlines; stops after the box's last row), with a 1-pixel margin so that chroma
 * upsampling sees the same neighbours as in a full decode. Only with libjpeg-turbo (the same IDCT
 * and fancy upsampling as TorchCodec's decoder; _roi.py checks the output once per process).
 *
 * gc_transcode_restart: lossless transcode to baseline with a restart marker every k MCUs
 * (restart-marker stores). The DCT coefficients, quantisation tables and sampling factors are
 * kept, so any decoder gives the same pixels as for the original; only the entropy coding is redone
 * (optimised Huffman tables), with k <= 4 MCUs dividing the MCUs per row, so every MCU row is a
 * whole number of independently decodable segments. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

long gc_find_restarts(const unsigned char *in, unsigned long n, unsigned long start,
                      long long *pos, long cap, long long *eoi);

struct gc_err {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char msg[JMSG_LENGTH_MAX];
  char warning[JMSG_LENGTH_MAX]; /* the first warning's text, "" if none */
};

static void gc_error_exit(j_common_ptr cinfo) {
  struct gc_err *e = (struct gc_err *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, e->msg);
  longjmp(e->jump, 1);
}

/* Warnings (corrupt data decoded anyway): never to stderr; the first one's text is kept. */
static void gc_quiet(j_common_ptr cinfo) {
  struct gc_err *e = (struct gc_err *)cinfo->err;
  if (e->warning[0] == 0) (*cinfo->err->format_message)(cinfo, e->warning);
}

/* The narrowest decoded width (output pixels) at which every subsampled component keeps >= 3
 * samples across: libjpeg-turbo uses fancy (triangle) upsampling only for a component with more
 * than 2 samples across, so a narrower crop or sub-image would be upsampled differently from the
 * full image. */
static JDIMENSION gc_min_width(const struct jpeg_decompress_struct *d) {
  JDIMENSION need = 1;
  int c;
  for (c = 0; c < d->num_components; c++) {
    int hs = d->comp_info[c].h_samp_factor;
    if (hs > 0 && hs < d->max_h_samp_factor) {
      JDIMENSION n = (JDIMENSION)(2 * d->max_h_samp_factor / hs + 1);
      if (n > need) need = n;
    }
  }
  return need;
}

/* Whether a crop of a DCT-scaled decode equals the same crop of the whole scaled decode for these
 * sampling factors: measured true at 1/8 for all, but at 1/2 and 1/4 not when a component is
 * subsampled 4:1 one way and 2:1 the other (or 2:1 and 4:1), so only ratios of 1 or 2 each way,
 * and 4:1 one way with 1:1 the other, are taken. */
static int gc_scale_ok(const struct jpeg_decompress_struct *d) {
  int c;
  for (c = 0; c < d->num_components; c++) {
    int h = d->comp_info[c].h_samp_factor, v = d->comp_info[c].v_samp_factor, rh, rv;
    if (h <= 0 || v <= 0) return 0;
    rh = d->max_h_samp_factor / h;
    rv = d->max_v_samp_factor / v;
    if (rh * h != d->max_h_samp_factor || rv * v != d->max_v_samp_factor) return 0;
    if (!((rh <= 2 && rv <= 2) || (rh == 4 && rv == 1) || (rh == 1 && rv == 4))) return 0;
  }
  return 1;
}

#ifdef LIBJPEG_TURBO_VERSION
/* Rows top..top+h, columns left..left+w of the coded image decoded at scale 1/denom (denom 1, 2, 4
 * or 8: libjpeg-turbo's DCT scaling; the box is in scaled pixels), as RGB, into out (h * w * 3
 * bytes). Returns 0; 1 with the reason in errbuf; or 3 when denom > 1 and the sampling factors are
 * not ones gc_scale_ok accepts. Warnings (corrupt data that libjpeg decodes anyway) are counted
 * into *warnings when it is not NULL, and the first one's text goes to errbuf on success. */
int gc_decode_region(const unsigned char *in, unsigned long n, int denom, int top, int left, int h,
                     int w, unsigned char *out, int *warnings, char *errbuf, int errlen) {
  struct jpeg_decompress_struct d;
  struct gc_err err;
  JSAMPROW volatile row = NULL;
  JSAMPROW r;
  JDIMENSION xoff, cw, right, need;
  int y, y0;

  if (warnings) *warnings = 0;
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
    snprintf(errbuf, (size_t)errlen, "scale 1/%d is not one of 1, 1/2, 1/4, 1/8", denom);
    return 1;
  }
  memset(&d, 0, sizeof(d));
  err.warning[0] = 0;
  d.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = gc_error_exit;
  err.pub.output_message = gc_quiet;
  if (setjmp(err.jump)) {
    snprintf(errbuf, (size_t)errlen, "%s", err.msg);
    free(row);
    jpeg_destroy_decompress(&d);
    return 1;
  }
  jpeg_create_decompress(&d);
  jpeg_mem_src(&d, (unsigned char *)in, n);
  jpeg_read_header(&d, TRUE);
  if (denom > 1 && !gc_scale_ok(&d)) {
    snprintf(errbuf, (size_t)errlen, "no scaled decode for these sampling factors");
    jpeg_destroy_decompress(&d);
    return 3;
  }
  d.out_color_space = JCS_RGB; /* gray is replicated; CMYK is refused (error) */
  d.dct_method = JDCT_ISLOW;
  d.do_fancy_upsampling = TRUE;
  /* No block smoothing: libjpeg smooths the blocks of a progressive JPEG whose scans leave
   * coefficients incomplete using neighbouring blocks, and a crop has other neighbours at its
   * edges, so crops would differ from the crop of the whole image (found by fuzzing; a valid
   * JPEG whose scan script stops early, tests/data/progressive_incomplete.jpg). Complete JPEGs
   * are never smoothed, so their pixels do not change. */
  d.do_block_smoothing = FALSE;
  d.scale_num = 1;
  d.scale_denom = (unsigned int)denom;
  jpeg_start_decompress(&d);
  if (top < 0 || left < 0 || h <= 0 || w <= 0 ||
      (long long)top + h > (long long)d.output_height ||
      (long long)left + w > (long long)d.output_width) {
    snprintf(errbuf, (size_t)errlen, "region outside the %ux%u image", d.output_width,
             d.output_height);
    jpeg_destroy_decompress(&d);
    return 1;
  }
  /* 1 pixel of margin each side (upsampling's context), widened to gc_min_width, right first */
  xoff = left > 0 ? (JDIMENSION)left - 1 : 0;
  right = (JDIMENSION)left + (JDIMENSION)w + 1 < d.output_width
              ? (JDIMENSION)left + (JDIMENSION)w + 1 : d.output_width;
  need = gc_min_width(&d);
  if (need < 4) need = 4; /* a 2-pixel crop at column 0 upsamples chroma differently (measured) */
  if (right - xoff < need) right = xoff + need < d.output_width ? xoff + need : d.output_width;
  if (right - xoff < need) xoff = right > need ? right - need : 0;
  cw = right - xoff;
  if (xoff > 0 || cw < d.output_width) jpeg_crop_scanline(&d, &xoff, &cw); /* iMCU-aligned */
  row = r = (JSAMPROW)malloc((size_t)d.output_width * 3);
  if (r == NULL) {
    snprintf(errbuf, (size_t)errlen, "out of memory");
    jpeg_destroy_decompress(&d);
    return 1;
  }
  y0 = top > 0 ? top - 1 : 0;
  if (y0 > 0) jpeg_skip_scanlines(&d, (JDIMENSION)y0);
  for (y = y0; y < top + h; y++) {
    jpeg_read_scanlines(&d, &r, 1);
    if (y >= top)
      memcpy(out + (size_t)(y - top) * (size_t)w * 3, r + (size_t)(left - (int)xoff) * 3,
             (size_t)w * 3);
  }
  free(r);
  row = NULL;
  if (warnings) *warnings = (int)err.pub.num_warnings;
  if (err.pub.num_warnings) snprintf(errbuf, (size_t)errlen, "%s", err.warning);
  jpeg_abort_decompress(&d); /* the rows below the box are never decoded */
  jpeg_destroy_decompress(&d);
  return 0;
}
#endif

static int gc_restart_mcus(const struct jpeg_decompress_struct *d) {
  int mcu_w = d->num_components == 1 ? DCTSIZE : d->max_h_samp_factor * DCTSIZE;
  int per_row = (int)((d->image_width + mcu_w - 1) / mcu_w);
  int k;
  for (k = 4; k > 1; k--)
    if (per_row % k == 0) return k;
  return 1;
}

static int gc_is(const jpeg_saved_marker_ptr m, int marker, const char *tag, unsigned n) {
  return m->marker == marker && m->data_length >= n && memcmp(m->data, tag, n) == 0;
}

/* A growing memory destination whose live buffer is always known here (jpeg_mem_dest frees and
 * replaces its buffer when it grows, so an error path cannot tell which pointer is live). */
struct gc_dest {
  struct jpeg_destination_mgr pub;
  unsigned char *buf;
  size_t size;
};

static void gc_dest_init(j_compress_ptr c) {
  struct gc_dest *d = (struct gc_dest *)c->dest;
  d->pub.next_output_byte = d->buf;
  d->pub.free_in_buffer = d->size;
}

static boolean gc_dest_grow(j_compress_ptr c) {
  struct gc_dest *d = (struct gc_dest *)c->dest;
  unsigned char *p = (unsigned char *)realloc(d->buf, d->size * 2);
  if (p == NULL) ERREXIT1(c, JERR_OUT_OF_MEMORY, 10);
  d->pub.next_output_byte = p + d->size;
  d->pub.free_in_buffer = d->size;
  d->buf = p;
  d->size *= 2;
  return TRUE;
}

static void gc_dest_term(j_compress_ptr c) { (void)c; }

/* Transcode in[0:n]. On success returns 0, *out (free with gc_free) holds *out_n bytes and *k the
 * restart interval in MCUs. On failure returns 1 with the libjpeg message in errbuf, and nothing
 * is left allocated. */
int gc_transcode_restart(const unsigned char *in, unsigned long n, unsigned char **out,
                         unsigned long *out_n, int *k, char *errbuf, int errlen) {
  struct jpeg_decompress_struct d;
  struct jpeg_compress_struct c;
  struct gc_err err;
  struct gc_dest *dest;
  volatile int have_c = 0;
  jvirt_barray_ptr *coefs;
  jpeg_saved_marker_ptr m;
  int i;

  *out = NULL;
  *out_n = 0;
  *k = 0;
  /* the manager and its buffer live on the heap, not in this frame, so longjmp keeps them */
  dest = (struct gc_dest *)malloc(sizeof(*dest));
  if (dest != NULL) {
    dest->size = n + 4096;
    dest->buf = (unsigned char *)malloc(dest->size);
  }
  if (dest == NULL || dest->buf == NULL) {
    free(dest);
    snprintf(errbuf, (size_t)errlen, "out of memory");
    return 1;
  }
  dest->pub.init_destination = gc_dest_init;
  dest->pub.empty_output_buffer = gc_dest_grow;
  dest->pub.term_destination = gc_dest_term;
  memset(&d, 0, sizeof(d));
  memset(&c, 0, sizeof(c));
  err.warning[0] = 0;
  d.err = jpeg_std_error(&err.pub);
  c.err = &err.pub;
  err.pub.error_exit = gc_error_exit;
  err.pub.output_message = gc_quiet;
  if (setjmp(err.jump)) {
    snprintf(errbuf, (size_t)errlen, "%s", err.msg);
    if (have_c) jpeg_destroy_compress(&c);
    jpeg_destroy_decompress(&d);
    free(dest->buf);
    free(dest);
    return 1;
  }
  jpeg_create_decompress(&d);
  jpeg_mem_src(&d, (unsigned char *)in, n);
  jpeg_save_markers(&d, JPEG_COM, 0xFFFF);
  for (i = 0; i < 16; i++) jpeg_save_markers(&d, JPEG_APP0 + i, 0xFFFF);
  jpeg_read_header(&d, TRUE);
  coefs = jpeg_read_coefficients(&d);

  jpeg_create_compress(&c);
  have_c = 1;
  c.dest = &dest->pub;
  jpeg_copy_critical_parameters(&d, &c);
  c.optimize_coding = TRUE;
  c.restart_interval = (unsigned int)(*k = gc_restart_mcus(&d));
  jpeg_write_coefficients(&c, coefs);
  for (m = d.marker_list; m != NULL; m = m->next) { /* EXIF (orientation), ICC, comments... */
    if (c.write_JFIF_header && gc_is(m, JPEG_APP0, "JFIF", 5)) continue; /* written already */
    if (c.write_Adobe_marker && gc_is(m, JPEG_APP0 + 14, "Adobe", 5)) continue;
    jpeg_write_marker(&c, m->marker, m->data, m->data_length);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  jpeg_finish_decompress(&d);
  jpeg_destroy_decompress(&d);
  *out = dest->buf;
  *out_n = (unsigned long)(dest->size - dest->pub.free_in_buffer);
  free(dest);
  return 0;
}

void gc_free(void *p) { free(p); }

/* Offsets of the 0xFF of every RSTn marker in in[start:n] (at most cap, into pos) and of the
 * first EOI (into *eoi, n if none). Returns the number of RSTn markers, or -1 past cap. In entropy-
 * coded data 0xFF is followed by 0x00 (stuffing), so any other pair is a marker. */
long gc_find_restarts(const unsigned char *in, unsigned long n, unsigned long start,
                      long long *pos, long cap, long long *eoi) {
  const unsigned char *p = in + start, *end = in + n;
  long count = 0;
  *eoi = (long long)n;
  while (p + 1 < end && (p = memchr(p, 0xFF, (size_t)(end - p - 1))) != NULL) {
    unsigned char m = p[1];
    if (m >= 0xD0 && m <= 0xD7) {
      if (count == cap) return -1;
      pos[count++] = (long long)(p - in);
    } else if (m == 0xD9) {
      *eoi = (long long)(p - in);
      break;
    }
    p += 2;
  }
  return count;
}

#ifdef LIBJPEG_TURBO_VERSION
/* Box (top, left, h, w), in pixels at scale 1/denom, of a restart-marker JPEG (baseline, one
 * interleaved scan, restart interval k MCUs dividing the MCUs per row): the segments covering the
 * box + 1 pixel are copied, renumbered, under the original headers with the SOF size patched, into
 * a smaller valid JPEG, which gc_decode_region decodes. Returns 0, 1 (error in errbuf), 2 (not
 * such a JPEG) or 3 (no scaled decode for its sampling factors, as gc_decode_region). */
int gc_decode_segments(const unsigned char *in, unsigned long n, int k, int denom, int top,
                       int left, int h, int w, unsigned char *out, int *warnings, char *errbuf,
                       int errlen) {
  unsigned long pos = 2, sof = 0, sos_end = 0, len;
  int dri = 0, nf = 0, ns = 0, c, mcu_w, mcu_h, max_h = 1, max_v = 1, min_h = 4, per_row, rows;
  int spr, seg_w, t0, b0, l0, r0, ra, rb, ca, cb, r, sub_h, sub_w, height, width, sh, sw, ret;
  long nseg, count = 0, i, out_n = 0;
  long long eoi;
  long long *rst;
  unsigned char *sub, m;
  unsigned marker_no = 0;

  if (warnings) *warnings = 0;
  while (pos + 4 <= n && in[pos] == 0xFF) {
    m = in[pos + 1];
    len = ((unsigned long)in[pos + 2] << 8) | in[pos + 3];
    if (m == 0xC0 || m == 0xC1) sof = pos;
    else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) return 2;
    else if (m == 0xDD && pos + 6 <= n) dri = (in[pos + 4] << 8) | in[pos + 5];
    else if (m == 0xDA) {
      ns = pos + 4 < n ? in[pos + 4] : 0;
      sos_end = pos + 2 + len;
      break;
    }
    pos += 2 + len;
  }
  if (!sof || !sos_end || sos_end > n || dri != k || k <= 0 || sof + 10 > n) return 2;
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) return 2;
  height = (in[sof + 5] << 8) | in[sof + 6];
  width = (in[sof + 7] << 8) | in[sof + 8];
  nf = in[sof + 9];
  if (nf != ns || nf < 1 || sof + 10 + 3 * (unsigned long)nf > n || height <= 0 || width <= 0)
    return 2;
  for (c = 0; c < nf; c++) {
    int hv = in[sof + 11 + 3 * c];
    if ((hv >> 4) < 1 || (hv >> 4) > 4 || (hv & 15) < 1 || (hv & 15) > 4) return 2;
    if ((hv >> 4) > max_h) max_h = hv >> 4;
    if ((hv >> 4) < min_h) min_h = hv >> 4;
    if ((hv & 15) > max_v) max_v = hv & 15;
  }
  mcu_w = nf == 1 ? 8 : 8 * max_h;
  mcu_h = nf == 1 ? 8 : 8 * max_v;
  per_row = (width + mcu_w - 1) / mcu_w;
  rows = (height + mcu_h - 1) / mcu_h;
  if (per_row % k) return 2;
  spr = per_row / k;
  seg_w = k * mcu_w;
  nseg = (long)rows * spr;
  sh = (height + denom - 1) / denom; /* the scaled image, as libjpeg sizes it */
  sw = (width + denom - 1) / denom;
  if (top < 0 || left < 0 || h <= 0 || w <= 0 || (long long)top + h > sh ||
      (long long)left + w > sw) {
    snprintf(errbuf, (size_t)errlen, "region outside the %dx%d image", sw, sh);
    return 1;
  }
  /* the box + 1 scaled pixel, in full-size pixels (all of it now < 65536: no overflow) */
  t0 = (top > 0 ? top - 1 : 0) * denom;
  b0 = (top + h + 1) * denom < height ? (top + h + 1) * denom : height;
  l0 = (left > 0 ? left - 1 : 0) * denom;
  r0 = (left + w + 1) * denom < width ? (left + w + 1) * denom : width;
  ra = t0 / mcu_h;
  rb = (b0 - 1) / mcu_h;
  ca = l0 / seg_w;
  cb = (r0 - 1) / seg_w;
  /* a sub-image too narrow for fancy upsampling of every component (see gc_min_width; in scaled
   * pixels) takes the previous segment column too, or the next one at the image's left edge */
  for (;;) {
    sub_w = ((cb + 1) * seg_w < width ? (cb + 1) * seg_w : width) - ca * seg_w;
    if (nf == 1 || min_h == max_h || sub_w >= (2 * max_h / min_h + 1) * denom) break;
    if (ca > 0) ca--;
    else if (cb < spr - 1) cb++;
    else break;
  }
  sub_h = ((rb + 1) * mcu_h < height ? (rb + 1) * mcu_h : height) - ra * mcu_h;
  if (ra < 0 || rb >= rows || ra > rb || ca < 0 || cb >= spr || ca > cb) {
    snprintf(errbuf, (size_t)errlen, "segment range outside the image");
    return 1;
  }
  rst = (long long *)malloc(sizeof(long long) * (size_t)(nseg + 1));
  sub = (unsigned char *)malloc(n + 2 * (size_t)rows + 16);
  if (rst == NULL || sub == NULL) {
    free(rst);
    free(sub);
    snprintf(errbuf, (size_t)errlen, "out of memory");
    return 1;
  }
  count = gc_find_restarts(in, n, sos_end, rst, nseg, &eoi);
  if (count != nseg - 1) {
    free(rst);
    free(sub);
    return 2;
  }
  rst[count] = eoi; /* segment s spans [s ? rst[s-1] + 2 : sos_end, rst[s]) */
  memcpy(sub, in, sos_end);
  sub[sof + 5] = (unsigned char)(sub_h >> 8);
  sub[sof + 6] = (unsigned char)(sub_h & 255);
  sub[sof + 7] = (unsigned char)(sub_w >> 8);
  sub[sof + 8] = (unsigned char)(sub_w & 255);
  out_n = (long)sos_end;
  for (r = ra; r <= rb; r++) {
    long first = (long)r * spr + ca, last = (long)r * spr + cb;
    long long start = first ? rst[first - 1] + 2 : (long long)sos_end;
    for (i = first; i <= last; i++) { /* each segment, then its (renumbered) marker */
      long long s0 = i == first ? start : rst[i - 1] + 2;
      memcpy(sub + out_n, in + s0, (size_t)(rst[i] - s0));
      out_n += (long)(rst[i] - s0);
      if (!(r == rb && i == last)) {
        sub[out_n++] = 0xFF;
        sub[out_n++] = (unsigned char)(0xD0 + (marker_no++ & 7));
      }
    }
  }
  sub[out_n++] = 0xFF;
  sub[out_n++] = 0xD9;
  free(rst);
  /* mcu_h and seg_w are multiples of 8, so the sub-image starts on a scaled pixel */
  ret = gc_decode_region(sub, (unsigned long)out_n, denom, top - ra * mcu_h / denom,
                         left - ca * seg_w / denom, h, w, out, warnings, errbuf, errlen);
  free(sub);
  return ret;
}
#endif
