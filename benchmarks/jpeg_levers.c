/* What bounds a photo's JPEG decode, measured against the system libjpeg-turbo (one core):
 * Huffman decoding alone (jpeg_read_coefficients) against a full decode; the full decode's stages
 * told apart by what each variant leaves out (to YCbCr: no colour conversion; to grayscale: no
 * chroma IDCT or upsampling, only the chroma's Huffman decoding; the fast integer IDCT; no fancy
 * upsampling); and the eval centre crop's box (Resize 256 + CenterCrop 224: 224/256 of the short
 * side, square, centred) decoded at each DCT scale M/8, M = 8..4, with libjpeg-turbo's crop and
 * skip, as the compiled decoder does.
 *
 *   gcc -O2 benchmarks/jpeg_levers.c -o /tmp/jpeg_levers -ljpeg
 *   find ../shared/data/hymenoptera -name '*.jpg' > /tmp/photos.txt
 *   /tmp/jpeg_levers /tmp/photos.txt 3
 *   valgrind --tool=callgrind /tmp/jpeg_levers /tmp/photos.txt 1 1   # the full decode alone
 *
 * Prints the median over rounds of the mean ms per image, and for each scale how many images'
 * box still comes out at least 224 pixels (the eval output) at that scale. Files that libjpeg
 * refuses (or that are not 3-component) are skipped and counted. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jpeglib.h>

struct err {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
};

static void on_error(j_common_ptr c) { longjmp(((struct err *)c->err)->jump, 1); }
static void quiet(j_common_ptr c) { (void)c; }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

enum { COEFS, FULL, FULL_YCC, FULL_GRAY, FULL_IFAST, FULL_PLAIN_UP, BOX, MODES = BOX + 5 };

/* mode COEFS: coefficients only; FULL..FULL_PLAIN_UP: a full decode (variants above); BOX: the
 * centre box at scale num/8. Returns seconds, or -1 if libjpeg refused the file; *box gets the box
 * side (BOX). */
static double decode(const unsigned char *buf, unsigned long n, int mode, int num, int *box) {
  struct jpeg_decompress_struct d;
  struct err e;
  JSAMPROW volatile row = NULL;
  double t0;
  d.err = jpeg_std_error(&e.pub);
  e.pub.error_exit = on_error;
  e.pub.output_message = quiet;
  if (setjmp(e.jump)) {
    free(row);
    jpeg_destroy_decompress(&d);
    return -1;
  }
  jpeg_create_decompress(&d);
  jpeg_mem_src(&d, (unsigned char *)buf, n);
  jpeg_read_header(&d, TRUE);
  if (d.num_components != 3) longjmp(e.jump, 1);
  d.out_color_space = mode == FULL_YCC ? JCS_YCbCr : mode == FULL_GRAY ? JCS_GRAYSCALE : JCS_RGB;
  d.dct_method = mode == FULL_IFAST ? JDCT_IFAST : JDCT_ISLOW;
  d.do_fancy_upsampling = mode == FULL_PLAIN_UP ? FALSE : TRUE;
  t0 = now();
  if (mode == COEFS) {
    jpeg_read_coefficients(&d);
  } else {
    JDIMENSION w, h, side, top, left, x, cw, y;
    d.scale_num = (unsigned)(mode < BOX ? 8 : num);
    d.scale_denom = 8;
    jpeg_start_decompress(&d);
    w = d.output_width;
    h = d.output_height;
    row = (JSAMPROW)malloc((size_t)w * 3);
    if (mode < BOX) {
      while (d.output_scanline < h) jpeg_read_scanlines(&d, (JSAMPARRAY)&row, 1);
    } else {
      side = (JDIMENSION)((w < h ? w : h) * 224.0 / 256);
      top = (h - side) / 2;
      left = (w - side) / 2;
      x = left > 0 ? left - 1 : 0; /* one pixel of margin, as the compiled decoder */
      cw = side + 2 < w - x ? side + 2 : w - x;
      jpeg_crop_scanline(&d, &x, &cw);
      if (top > 1) jpeg_skip_scanlines(&d, top - 1);
      for (y = top > 1 ? top - 1 : 0; y < top + side; y++)
        jpeg_read_scanlines(&d, (JSAMPARRAY)&row, 1);
      *box = (int)side;
    }
  }
  t0 = now() - t0;
  free(row);
  row = NULL;
  jpeg_destroy_decompress(&d);
  return t0;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  static char name[4096];
  unsigned char **buf = NULL;
  unsigned long *len = NULL;
  int n = 0, cap = 0, rounds = argc > 2 ? atoi(argv[2]) : 3, k, r, i, refused = 0;
  int only = argc > 3 ? atoi(argv[3]) : -1; /* one variant alone (its index), e.g. under callgrind */
  const char *label[MODES] = {"coefficients only (Huffman)", "full decode",
                              "full, to YCbCr (no colour conv.)", "full, to gray (no chroma IDCT)",
                              "full, fast integer IDCT", "full, no fancy upsampling",
                              "box at 8/8", "box at 7/8", "box at 6/8", "box at 5/8",
                              "box at 4/8"};
  FILE *list = argc > 1 ? fopen(argv[1], "r") : NULL;
  if (list == NULL || rounds < 1) {
    fprintf(stderr, "usage: %s LIST_OF_JPEG_PATHS [ROUNDS]\n", argv[0]);
    return 2;
  }
  while (fgets(name, sizeof name, list)) {
    FILE *f;
    name[strcspn(name, "\n")] = 0;
    if (!name[0] || (f = fopen(name, "rb")) == NULL) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 256;
      buf = realloc(buf, sizeof(*buf) * (size_t)cap);
      len = realloc(len, sizeof(*len) * (size_t)cap);
    }
    fseek(f, 0, SEEK_END);
    len[n] = (unsigned long)ftell(f);
    rewind(f);
    buf[n] = malloc(len[n]);
    if (fread(buf[n], 1, len[n], f) == len[n]) n++;
    fclose(f);
  }
  fclose(list);
  /* rounds outermost, every variant in each: the machine's drift hits them all alike */
  double *mean = malloc(sizeof(double) * (size_t)rounds * MODES);
  int fits[MODES] = {0}, used[MODES] = {0};
  for (r = 0; r < rounds; r++) {
    for (k = 0; k < MODES; k++) {
      double total = 0;
      if (only >= 0 && k != only) continue;
      used[k] = fits[k] = refused = 0;
      for (i = 0; i < n; i++) {
        int box = 0;
        double t = decode(buf[i], len[i], k < BOX ? k : BOX, 8 - (k - BOX), &box);
        if (t < 0) {
          refused++;
          continue;
        }
        total += t;
        used[k]++;
        fits[k] += box >= 224;
      }
      mean[k * rounds + r] = used[k] ? total / used[k] * 1e3 : 0;
    }
  }
  for (k = 0; k < MODES; k++) {
    if (only >= 0 && k != only) continue;
    qsort(mean + k * rounds, (size_t)rounds, sizeof(double), by_value);
    printf("%-34s %.3f ms per image (median of %d rounds)", label[k],
           mean[k * rounds + rounds / 2], rounds);
    if (k >= BOX) printf(", box >= 224 px in %d of %d", fits[k], used[k]);
    printf("\n");
  }
  free(mean);
  printf("%d images read, %d refused or not 3-component\n", n, refused);
  return 0;
}
